"""Planning training runs at cluster scale (docs/SCALE.md)."""

from .calibrate import Measurement, calibrate
from .models import MODELS, TransformerConfig, get_model
from .plan import (ClusterPlan, ClusterPlans, MemoryPerGPU, cluster_names, evaluate_cluster,
                   load_cluster, plan_cluster)
from .profile import profile_model

__all__ = ["Measurement", "calibrate", "MODELS", "TransformerConfig", "get_model", "ClusterPlan", "ClusterPlans",
           "MemoryPerGPU", "cluster_names", "evaluate_cluster", "load_cluster", "plan_cluster",
           "profile_model"]
