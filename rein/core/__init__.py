"""What the API and the worker share: settings, the database (models, sessions, migrations) and API keys."""
