"""What `pip install .` gives a user: the wheel, installed apart from the work tree."""
