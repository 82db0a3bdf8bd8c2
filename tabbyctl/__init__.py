"""tabbyctl: the operator CLI (the only package that imports click)."""
