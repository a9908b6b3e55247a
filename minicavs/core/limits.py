"""Sizes the generated code is built for, in the base layer because layers above code generation respect them
too: the vertex declaration refuses an arity whose gathers would not fit a template's registers, and fusion
makes no kernel with more arguments than the C runner passes."""

MAX_REGISTERS = 512   # registers of one template of the C runner (the lowering refuses more)
MAX_ARGS = 64         # arguments of one fused kernel
