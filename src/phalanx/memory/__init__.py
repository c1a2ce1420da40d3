"""Memory manager (F16-F19): profile, plan, activation offload across tiers, host optimizer."""
