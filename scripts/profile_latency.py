#!/usr/bin/env python
"""Profile a latency table on this device (same as the ``sparsebalance-profile`` command).

    python scripts/profile_latency.py --out lat_cpu.json --quick
    python scripts/profile_latency.py --analytic --num-layers 24 --hidden-size 896 \
        --ffn-hidden-size 4864 --num-attention-heads 14 --num-query-groups 2 \
        --vocab-size 151936 --seq-length 32768 --pipeline-model-parallel-size 4 --out qwen_h100.json
"""

import sys

from sparsebalance_megatron.megatron.profile_cli import main

if __name__ == "__main__":
    sys.exit(main())
