"""lightning-slide: full-parameter LLM fine-tuning on one GPU, as a Lightning strategy.

Importing the package registers ``Trainer(strategy="slideformer")``.
"""

from lightning.pytorch.strategies import StrategyRegistry

import lightning_slide._checkout  # noqa: F401  (first: maps the checkout's ops/ when run uninstalled)
from lightning_slide.config import SlideConfig
from lightning_slide.engine import SlideEngine
from lightning_slide.precision import SlidePrecision
from lightning_slide.step_mode import StepMode
from lightning_slide.strategy import SlideStrategy

if SlideStrategy.strategy_name not in StrategyRegistry:
    SlideStrategy.register_strategies(StrategyRegistry)
from lightning_slide.fabric import SlideFabricStrategy  # noqa: E402,F401  (registers Fabric(strategy="slideformer"))

__all__ = ["SlideConfig", "SlideEngine", "SlidePrecision", "SlideStrategy", "StepMode"]
