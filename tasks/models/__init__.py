"""Models and devices: where a model comes from (sources.py), loading it here (loading.py), what a family or a CPU
needs (quirks.py), dequantizing for evaluation (dequantize.py), device memory between stages (memory.py), a
model's dimensions whatever its family calls them (dims.py)."""
