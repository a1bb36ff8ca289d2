"""``python -m mmrlhf ...`` (also ``torchrun ... -m mmrlhf train CONFIG``): the ``mmrlhf`` command."""

from mmrlhf.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
