"""The API's routes, one module per area: openai (completions, chat, models), jobs, usage,
health."""
