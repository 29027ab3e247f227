"""The RL example's entry point: ``python examples/rl_sim/train.py`` under torchrun.

The code lives in ``pdctl/examples/rl_sim.py`` so that every node with pdctl installed can run
it as ``python -m pdctl.examples.rl_sim`` (what ``topologies/rl-sim.yaml`` does); read it there.
"""

from pdctl.examples.rl_sim import main

if __name__ == "__main__":
    main()
