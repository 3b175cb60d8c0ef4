"""Serving LoRA adapters: adapter directories (adapter.py), slot buffers and the name -> slot table
(manager.py), batched LoRA ops (ops.py, triton_ops.py), the wrapped linears (linear.py) and the
routed experts' LoRA (experts.py), the engine's per-batch hook (batch.py)."""
