"""hooks.finish(): the process groups are destroyed once pretrain() has returned (a finished gloo
rank otherwise can abort at interpreter exit, pytorch#190489); without a group it does nothing;
the interpreter's exit after it leaves the objects to the OS."""

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


def test_after_finish_the_exit_leaves_the_objects_to_the_os():
    """A finished rank's exit does not collect what torch and Megatron leave (seconds of CPU
    per rank): garbage still in a cycle at exit is never finalized after finish(); without
    finish() the interpreter's last collection finalizes it."""
    code = textwrap.dedent("""
        import gc, sys
        from sparsebalance_megatron.megatron import hooks
        gc.disable()
        class Cycle:
            def __del__(self):
                sys.stdout.write("finalized\\n")
        c = Cycle(); c.self = c; del c
        if sys.argv[1] == "finish":
            hooks.finish()
        print("end")
    """)
    for arg, want in (("finish", "end"), ("no", "end\nfinalized")):
        out = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == want, (arg, out.stdout, out.stderr)
