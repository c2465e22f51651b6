"""Webhooks: a job's terminal state POSTed, signed, to the URL given at submit."""
