"""What the tools share: the streaming OpenAI client and the server runner
(``client``), sample statistics (``stats``), the locally generated tiny
model (``tiny_model``), vLLM's scheduler driven on a virtual clock
(``scheduler_driver``) and help text as a terminal shows it
(``help_text``)."""
