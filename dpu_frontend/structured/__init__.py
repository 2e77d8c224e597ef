"""Structured outputs and tool calling on the frontend: constraints compiled to token automata.

    request fields (response_format, structured_outputs, guided_*) -> request.parse -> Constraint
    tools / tool_choice -> tools.py: the tools rendered into the prompt, a Constraint for the
        forced choices (required, a named function), the model's <tool_call> text parsed back
    Constraint -> compiler.ConstraintCompiler (regex.py: schema -> regex; vocabulary.py: token
        bytes; outlines-core: regex -> token DFA; shared_layout.automaton: DFA -> ring words, cached)
    -> the automaton rides with the request in the ring; the daemon masks and steps it each token.
"""
