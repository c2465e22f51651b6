"""Plans: predicted quality-versus-size curves from a model's cached sensitivity profile."""
