"""User tools: the Python SDK (``client.sdk``: build job specs, call the control API) and the
``streamforge`` command line (``client.cli``) built on it, with sample data to produce.

They talk to the platform only through its public interfaces (the REST API and Kafka topics).
"""
