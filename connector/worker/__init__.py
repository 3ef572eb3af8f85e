"""The worker side: loads and saves, the step's copies, the engine's KV layout, block and
device copies."""
