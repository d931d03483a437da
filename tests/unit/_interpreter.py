"""Triton's interpreter as the ``interp`` worker runs it (``tests/unit/conftest.py``).

The interpreter's semantic computes an int32 overflow check for every integer ``+``, ``-`` and
``*`` of a kernel (both operands cast to int64, the result compared with int32's bounds) and
hands it to ``device_assert``, which drops it unless the options' ``debug`` is set; the
interpreter never sets it. That dead work is about two fifths of an interpreted kernel's time
at the tests' shapes. ``skip_dead_overflow_checks`` turns the computation off where ``debug``
is off (where an assert would fire, it leaves it on), and
``test_attention_triton.check_overflow_checks_are_dead`` keeps the premise checked: with the
computation on, an int32 overflow in a kernel still raises nothing."""


def skip_dead_overflow_checks() -> bool:
    """Off where ``device_assert`` drops the check anyway; True where it was turned off."""
    from dataclasses import replace

    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    if builder.options.debug:
        return False
    builder.options = replace(builder.options, sanitize_overflow=False)
    return True
