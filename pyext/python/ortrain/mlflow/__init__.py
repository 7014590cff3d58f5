"""`python -m ortrain.mlflow replay FILE`: tools around ortrain's MLflow logging."""
