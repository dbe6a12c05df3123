"""``python -m eagle_training [--models smollm2] [--minutes 24] [--out dir]``."""

from eagle_training.train import main

if __name__ == "__main__":
    main()
