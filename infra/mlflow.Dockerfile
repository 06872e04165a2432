# MLflow server with what a Postgres backend and an S3 artifact store need (the compose file builds it;
# s3-init uses it too, for boto3). The version matches the one the project pins.
FROM python:3.11-slim
ARG MLFLOW_VERSION=3.17.2
RUN pip install --no-cache-dir "mlflow==${MLFLOW_VERSION}" psycopg2-binary boto3
EXPOSE 5000
