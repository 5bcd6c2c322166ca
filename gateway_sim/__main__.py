"""`python -m gateway_sim --port N`: the simulated gateway on its own, for the demo and benchmarks."""

from gateway_sim.simulator import main

main()
