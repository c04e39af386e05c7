"""Training wing: trainers, callbacks, recipes."""
