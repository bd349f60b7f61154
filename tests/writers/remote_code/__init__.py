"""Source of a tiny remote-code model: copied into a checkpoint's huggingface/ folder, loaded with trust_remote_code."""
