"""The report's sections: view models and plots."""
