"""What a run tells: the console, metrics.jsonl and TensorBoard, W&B, the summary."""
