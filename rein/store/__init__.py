"""What the API, the batch manager and the worker keep and share: the SQLAlchemy tables and
sessions, the migrations' runner, API keys, Redis key names and clients, the queue-message and
stream-event shapes, and the file store (a local directory or S3-compatible storage)."""
