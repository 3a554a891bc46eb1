"""A rank's weights: where they come from and how they are made.

``weight_plan`` decides, before any work, whether each parameter comes from a
state dict, a HuggingFace checkpoint, the model's own values or its
initialisation, and checks it can; ``shards`` assembles a rank's shard from
reads of the full tensor; ``initialize`` and ``module_init`` initialise a
model on the meta device one module at a time, the same in every layout.
"""

from autopar.runtime.weights.initialize import init_weights
from autopar.runtime.weights.module_init import InitError
from autopar.runtime.weights.weight_plan import MissingWeightsError, WeightPlan, WeightsError, plan_weights

__all__ = ["init_weights", "InitError", "WeightPlan", "plan_weights", "WeightsError", "MissingWeightsError"]
