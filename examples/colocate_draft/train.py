"""The draft-head example's entry point: ``python examples/colocate_draft/train.py`` under torchrun.

The code lives in ``pdctl/examples/colocate_draft.py`` so that every node with pdctl installed can
run it as ``python -m pdctl.examples.colocate_draft`` (what ``topologies/colocate-draft-sim.yaml``
does); read it there.
"""

from pdctl.examples.colocate_draft import main

if __name__ == "__main__":
    main()
