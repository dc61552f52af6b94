"""`python3 -m dsat`."""

from dsat.cli import main_exit

main_exit()
