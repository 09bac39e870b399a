"""Run orchestration: the launcher, the deployment, the engines, Flower processes, the fleet gateway, the staged app."""
