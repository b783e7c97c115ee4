"""Rate stages for soak profiles: add beside the entry locustfile.

    locust -f locustfiles/calculet.py,locustfiles/stages.py --headless \\
        -H http://127.0.0.1:8000 --arrival poisson --stages "60@1,120@2,60@0.5"

Each stage is DURATION_S@RATE[@BURST_SIZE/BURST_EVERY_S]; or `--stages FILE.yaml` with a
list of {duration_s, rate, burst_size, burst_every_s}. The run stops after the last stage.
"""

from calculet_load.locust.plugin import CalculetUser
from calculet_load.locust.shape import RateStages

__all__ = ["CalculetUser", "RateStages"]
