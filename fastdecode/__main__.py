"""`python -m fastdecode ...`: the same as the `fastdecode` command (torchrun launches modules this way)."""
from fastdecode.cli import main

if __name__ == "__main__":
    main(prog_name="fastdecode")
