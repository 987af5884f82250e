"""The model API: load.py (`tritonq.load`: checkpoint -> model), model.py (`Model`, its generate / chat /
score), hub.py (Hugging Face Hub names -> local folders). tritonq/__init__.py re-exports the public names."""
