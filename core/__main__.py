"""``python -m infer``: the ``infer`` command line (what ``infer serve --data-parallel-size`` starts replicas with)."""

from infer.cli import main

if __name__ == "__main__":
    main()
