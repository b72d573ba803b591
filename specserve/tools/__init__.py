"""Tools apart from the serving path: bench, simulator, distillation, GPU check, measurements, chart schema."""
