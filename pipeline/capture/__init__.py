"""Capture: the target's aux hidden states, from hooks (hf) or SGLang's ModelRunner (engines/), into the
feature store or straight to training (online); the aux-layer numbering."""
