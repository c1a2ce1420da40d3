"""placeholder"""

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass
