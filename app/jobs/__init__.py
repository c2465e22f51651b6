"""Jobs: the state machine (state.py), queries (repository.py), rules (service.py), HTTP (routes.py)."""
