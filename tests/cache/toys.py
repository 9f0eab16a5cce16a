"""A stand-in for a stored span: the store only reads its size, tokens, start and fingerprint."""

from dataclasses import dataclass


@dataclass
class Toy:
    nbytes: int
    token_ids: tuple = (1, 2, 3, 4)
    start_pos: int = 0
    fingerprint: str = "fp"
