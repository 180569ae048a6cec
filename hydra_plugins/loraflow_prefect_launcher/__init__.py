"""Hydra launcher `hydra/launcher=prefect`: each sweep member is a run of a Prefect deployment."""
