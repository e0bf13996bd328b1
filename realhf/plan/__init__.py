"""Models of an execution plan's cost, from the model's shape and the layout alone (no weights, no torch):
``memory`` estimates what each rank holds and what each model function call adds on top, for the launcher's
check before start, the token budgets of ``max_tokens_per_mb=auto`` and the per-call estimates in the stats."""
