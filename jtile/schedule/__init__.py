"""Static scheduling on the graph: orders, early/late steps, memory, C-P pipelines, drawing, running.

`schedule(fn, *args, policy=, granularity=, cp=)` returns a `Schedule`;
`CPModel` is the consumer-producer model to subclass; `Roofline` and
`stripe_pipeline` time a double-buffered stripe pipeline; `seed_lstm` is
seed 002's LSTM as a JAX function.
"""

from ._cp import CPModel as CPModel
from ._dag import Node as Node
from ._memory import MemoryPlan as MemoryPlan
from ._memory import PlannedBuffer as PlannedBuffer
from ._schedule import Run as Run
from ._schedule import Schedule as Schedule
from ._schedule import schedule as schedule
