"""``python -m moepec`` (also what ``torchrun -m moepec`` runs on every rank)."""

from moepec.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
