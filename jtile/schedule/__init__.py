"""Static scheduling on the graph: orders, early/late steps, memory, C-P pipelines, drawing, running.

`schedule(fn, *args, policy=, granularity=, cp=)` returns a `Schedule`;
`CPModel` is the consumer-producer model to subclass; `Roofline` and
`stripe_pipeline` time a double-buffered stripe pipeline; `seed_lstm` is
seed 002's LSTM as a JAX function.
"""

from ._cp import CPModel as CPModel
from ._dag import Node as Node
from ._examples import seed_convs as seed_convs
from ._examples import seed_convs_params as seed_convs_params
from ._examples import seed_lstm as seed_lstm
from ._examples import seed_lstm_params as seed_lstm_params
from ._memory import MemoryPlan as MemoryPlan
from ._memory import PlannedBuffer as PlannedBuffer
from ._pipeline import Roofline as Roofline
from ._pipeline import Timeline as Timeline
from ._pipeline import stripe_pipeline as stripe_pipeline
from ._schedule import Run as Run
from ._schedule import Schedule as Schedule
from ._schedule import schedule as schedule

__all__ = [
    "CPModel", "MemoryPlan", "Node", "PlannedBuffer", "Roofline", "Run", "Schedule", "Timeline", "schedule",
    "seed_convs", "seed_convs_params", "seed_lstm", "seed_lstm_params", "stripe_pipeline",
]
