"""Extensions of hetero_gpt.py: they import it and it never imports them. Run each as
`python -m tools.<name>`."""
