"""hooks.finish(): the process groups are destroyed once pretrain() has returned (a finished gloo
rank otherwise can abort at interpreter exit, pytorch#190489); without a group it does nothing."""

import subprocess
import sys
import textwrap


def test_finish_destroys_the_process_groups(tmp_path):
    code = textwrap.dedent(f"""
        import torch.distributed as dist
        from sparsebalance_megatron.megatron import hooks
        hooks.finish()                                    # no group yet: nothing to do
        dist.init_process_group("gloo", init_method="file://{tmp_path}/init", rank=0,
                                world_size=1)
        sub = dist.new_group([0])
        assert dist.is_initialized()
        hooks.finish()
        assert not dist.is_initialized()
        hooks.finish()                                    # and again: still nothing to do
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
