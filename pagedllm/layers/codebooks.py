"""The values 4-bit codes stand for, by codebook (``QuantizedWeight.codebook``): GGUF types whose
4 bits index a table of 16 instead of being the value (and Q5_0's 5-bit q, which stand for
q - 16). The kernels keep the same tables in ``kernels/csrc/quant.h`` (``kCodebooks``),
numbered by their order here from 1; a test pins them to the gguf package's ``kvalues``.
Torch-free: the GGUF unpacker reads them too."""

CODEBOOKS: dict[str, tuple[int, ...]] = {
    "mxfp4": (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12),  # FP4 e2m1 values doubled
    "iq4_nl": (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),  # IQ4_NL and IQ4_XS
    # Q4_0's q - 8: its value is d x (q - 8) with no offset to store (an offset -8d per 32
    # columns cost 2 bytes more than the file's 18)
    "q4_0": tuple(range(-8, 8)),
    # Q5_0's q - 16, for its 5-bit q (32 values): the kernels subtract 16 rather than look it up
    "q5_0": tuple(range(-16, 16)),
}

# Each codebook's number in the kernels' ``bits`` argument (``QuantizedWeight.layout``), once.
CODEBOOK_NUMBERS: dict[str, int] = {name: number for number, name in enumerate(CODEBOOKS, start=1)}
