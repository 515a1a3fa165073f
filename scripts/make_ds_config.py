"""Write the DeepSpeed presets, or generate / validate one config: the same as ``trainer ds-config``.

python scripts/make_ds_config.py                      # = trainer ds-config presets
python scripts/make_ds_config.py generate --zero-stage 3 --precision bf16 --micro-batch 4 --world-size 16
python scripts/make_ds_config.py validate my_ds.json --world-size 8
"""

from __future__ import annotations

import sys

from trainer.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["ds-config", *(sys.argv[1:] or ["presets"])]))
