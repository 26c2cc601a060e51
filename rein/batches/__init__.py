"""The OpenAI Files and Batches API behind the routes: tenant-scoped queries and public views
(repository), line validation (validation), output and error files (output), and the batch
manager that moves batches through their statuses (manager), with its per-batch lock (locks),
the batch's job rows (batch_jobs) and the fairness between tenants (fairness)."""
