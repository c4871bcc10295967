"""The platform's own shared package: settings, Kafka helpers, job specs, constants."""
