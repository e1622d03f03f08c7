"""ETTR simulator behind ``leto-run sim`` (paper §8.6, Appendix C).

``config`` reads scenario files, ``itermodel`` predicts iteration time (Appendix C.1),
``closed_form`` evaluates Eq. 6-8 and Young's interval, ``montecarlo`` replays the same
run as failure events, ``evaluate`` ties them together, ``report`` and ``plots`` write
the rich table, the JSON file and the PNG figures.
"""

from leto.sim.config import Scenario, load_scenario
from leto.sim.evaluate import ScenarioResult, closed_form, evaluate

__all__ = ["Scenario", "ScenarioResult", "closed_form", "evaluate", "load_scenario"]
