"""Pure control: the rate model and K choice, the K controller, the step-cost fit, autoscaling decisions."""
