-- Runs once, when the postgres volume is first initialised: the MLflow backend store next to Prefect's.
CREATE DATABASE mlflow OWNER gyre;
