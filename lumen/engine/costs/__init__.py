"""Step costs: what a step of the engine costs on this machine, and the token budget chosen from it.

    steps.py   StepCosts (every step's wall time by token count) and CostModel (step time as a function of the
               step's shape, fitted to measurements, cached per model, machine, code and thread count)
    budget.py  MeasuredBudget: the measured scheduler's per-step token budget from the cost model and the SLOs
"""
